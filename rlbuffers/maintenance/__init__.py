"""What is done to a stored buffer outside training: inspect a commit, check and repair its
chunks, export it as a plain Zarr group (the ``rlbuffers inspect`` / ``verify`` commands), read
its episodes in bounded memory (``episodes``: what the offline exports stream from)."""
