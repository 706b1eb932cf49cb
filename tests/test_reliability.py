"""kill -9 at any point loses nothing: a chain of SIGKILLed runs in one workdir, then a run that
completes, reproduces the uninterrupted run bitwise (metrics and final checkpoint), per placement.

Each killed run is a real `python launch.py` process killed with SIGKILL, either from inside at a
fault point chosen by a seeded RNG (megatrain_jax/faults.py: forward, backward, optimizer
write-back, checkpoint save) or from outside at a random time (in the start-up: imports, data,
checkpoint restore, NVMe live-store rebuild; or in the training). Chaining the kills in one
workdir (each run resumes from whatever the previous one left) gives several kill points per
placement for the price of one extra process start each.

The harness (launching the runs, kill plans, comparing what they leave) is
megatrain_jax/reliability.py; bench/reliability.py runs it with more kills, flipped checkpoint
bytes and full disks.
"""

import random
import signal

import pytest

from megatrain_jax import faults
from megatrain_jax import metrics
from megatrain_jax.reliability import (EXTERNAL, PLACEMENTS, STEPS, final_state, kill_chain,
                                       kill_plan, launch, learning_rows, phases_for,
                                       placement_fields, read_rows, states_equal)


@pytest.mark.parametrize('placement', list(PLACEMENTS))
def test_kill_chain_resumes_bitwise(tmp_path, shared_data, placement):
  fields = placement_fields(placement)
  reference = launch(tmp_path / 'reference', fields)
  assert reference.returncode == 0, reference.output[-3000:]
  expected = learning_rows(read_rows(tmp_path / 'reference'))

  # This seed gives resident both EXTERNAL kills, host 'external', nvme 'startup'.
  rng = random.Random(f'issue-6-{placement}')
  plan = kill_plan(rng, placement, kills=5)
  kills = kill_chain(tmp_path / 'chain', placement, plan, rng, reference)
  for kill in kills:
    assert kill.returncode == -signal.SIGKILL, (kill.kind, kill.fault, kill.detail)
    if kill.kind not in EXTERNAL:  # died where it was told to, not somewhere else
      assert f'faults: SIGKILL at {kill.fault.replace(":", " pass ")}' in kill.detail, kill.detail
    assert not kill.lost, kill
  assert set(phases_for(placement)) <= {k.kind for k in kills}

  final = launch(tmp_path / 'chain', fields)
  assert final.returncode == 0, final.output[-3000:]
  got = learning_rows(read_rows(tmp_path / 'chain'))
  # Bitwise: every float compared with ==, every step 1..12 once, evals at 0, 4, 8, 12 once.
  assert got == expected, [k.fault for k in kills]
  assert [r['step'] for r in got if 'learning/loss' in r] == list(range(1, STEPS + 1))
  assert [r['step'] for r in got if 'eval/loss' in r] == [0, 4, 8, 12]
  assert states_equal(final_state(tmp_path / 'chain', fields),
                      final_state(tmp_path / 'reference', fields))


def test_a_fresh_start_drops_the_rows_of_a_killed_first_attempt(tmp_path):
  """A run killed before its first checkpoint leaves a step-0 eval row (and maybe more); the
  rerun starts from scratch and must not log step 0 twice."""
  (tmp_path / 'metrics.jsonl').write_text('{"step": 0, "eval/loss": 5.5}\n{"step": 1, "learning/loss": 5.4}\n')
  with metrics.MetricsWriter(tmp_path, total_steps=4, start_step=0, progress_bar=False) as writer:
    writer.write(0, {'eval/loss': 5.5}, console=False)
  assert read_rows(tmp_path) == [{'step': 0, 'eval/loss': 5.5}]


def test_a_raise_fault_point_raises_on_its_pass_and_typos_are_refused(monkeypatch):
  """MEGATRAIN_FAULT=PHASE:N:raise raises InjectedFault at the N-th pass (an error inside one
  process, test_distributed.py); a misspelt action is refused, not ignored."""
  monkeypatch.setattr(faults, '_counts', {})
  monkeypatch.setenv(faults.ENV, 'backward:2:raise')
  faults.point('forward')  # other phases do not count
  faults.point('backward')
  with pytest.raises(faults.InjectedFault, match='backward pass 2'):
    faults.point('backward')
  faults.point('backward')  # the third pass is past it
  monkeypatch.setenv(faults.ENV, 'backward:2:rais')
  with pytest.raises(ValueError, match='PHASE:N:raise'):
    faults.point('backward')
