"""Single-file reference trainers built on rlbuffers (run as ``python -m trainers.<name>``)."""
