"""absl entry points: `python -m launch.<job> --config=... --workdir=...`."""
