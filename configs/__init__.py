"""Training configs: `default.py` documents every field; size presets override only what differs."""
