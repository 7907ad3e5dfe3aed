"""Fuzz the stream's tar reader: mutated shards (ustar, GNU long names, pax, written by
``write_shards``) and the pax header of issue 32 C1, with header checksums often repaired so
mutations reach the fields behind them. Property: reading a shard to its end returns or
raises an rlbuffers error (``ShardError``), never loops, never reads a member larger than
``max_record_bytes``.

``python -m tools.fuzz.fuzz_tar --minutes 10``"""

from __future__ import annotations

import io
import random
import tarfile
import tempfile
from pathlib import Path

from tools.fuzz.common import Finding, check_only_own_errors, mutate_bytes, octal_field, run

MAX_RECORD = 2**16


def seeds() -> list[bytes]:
    from rlbuffers.stream import write_shards
    from tests import hostile_inputs as h

    out = [h.valid_tar(3), h.c1_pax_zero_length()]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("k/" + "n" * 120 + ".json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    out.append(buf.getvalue())
    with tempfile.TemporaryDirectory() as d:
        write_shards(d, records=[{"text": f"doc {i}"} for i in range(5)], progress=False)
        write_shards(Path(d) / "one", records=["a", "b"], records_per_sample=1,
                     progress=False)
        out += [Path(d, "shard-000000.tar").read_bytes(),
                Path(d, "one", "shard-000000.tar").read_bytes()]
    return out


def fix_checksums(data: bytes) -> bytes:
    """Recompute the checksum of every block that looks like a tar header."""
    b = bytearray(data)
    for at in range(0, len(b) - 511, 512):
        block = b[at:at + 512]
        if block[257:262] == b"ustar":
            block[148:156] = b" " * 8
            block[148:156] = octal_field(sum(block), 8)[:7] + b" "
            b[at:at + 512] = block
    return bytes(b)


class Fuzz:
    def __init__(self, workdir: Path) -> None:
        self.work = Path(workdir)
        self.seeds = seeds()

    def generate(self, rng: random.Random) -> bytes:
        data = mutate_bytes(rng.choice(self.seeds), rng)
        return fix_checksums(data) if rng.random() < 0.7 else data

    def check(self, data: bytes) -> None:
        from rlbuffers.stream import iter_shard
        from rlbuffers.stream.tario import iter_members

        path = self.work / "shard.tar"
        path.write_bytes(data)
        for read in (lambda: [len(p) for _, p in iter_members(io.BytesIO(data),
                                                              max_record_bytes=MAX_RECORD)],
                     lambda: [len(s) for s in iter_shard(str(path), find_manifest=False,
                                                         max_record_bytes=MAX_RECORD)]):
            try:
                sizes = read()
            except Finding:
                raise
            except BaseException as exn:  # noqa: BLE001 - the property is about what escapes
                check_only_own_errors(exn)
                continue
            if read is not None and any(n > MAX_RECORD + 64 for n in sizes):
                raise Finding(f"a record over max_record_bytes was returned: {max(sizes)}")


if __name__ == "__main__":
    raise SystemExit(run("tools.fuzz.fuzz_tar", __doc__ or ""))
