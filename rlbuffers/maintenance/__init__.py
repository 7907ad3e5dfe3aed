"""What is done to a stored buffer outside training: inspect a commit, check and repair its
chunks, export it as a plain Zarr group (the ``rlbuffers inspect`` / ``verify`` commands)."""
