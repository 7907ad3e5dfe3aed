"""Where a buffer's bytes live: the working tier (memory-mapped files), the persistent tier
(a Zarr v3 group) behind one interface, the typed manifest (a commit), the chunk layout,
background saves in bounded runs, the writer lock and reader leases, and the one safe-write
helper (no symlinks, no FIFOs, nothing outside the buffer's root)."""
