import argparse
import json
import subprocess
import sys
from pathlib import Path

from rlbuffers.cli.shards import add_shards_parser
from rlbuffers.stream import iter_shard, resolve_shards


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_shards_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_shards_write_and_ls(tmp_path: Path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": "t" * (i * 97 % 4000)}) + "\n" for i in range(60)))
    out = tmp_path / "out"
    assert run(["shards", "write", str(src), "--out", str(out), "--max-shard-bytes", "40KiB",
                "--no-progress"]) == 0
    urls = resolve_shards(out)
    assert len(urls) > 1 and all(Path(u).stat().st_size <= 40 * 1024 for u in urls)
    assert sum(1 for u in urls for _ in iter_shard(u)) == 60
    assert "wrote 60 samples" in capsys.readouterr().out
    assert run(["shards", "ls", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("total\t60")
    grouped = tmp_path / "grouped"
    assert run(["shards", "write", str(src), "--out", str(grouped), "--records-per-sample", "8",
                "--no-progress"]) == 0
    assert [s["json"] for u in resolve_shards(grouped) for s in iter_shard(u)] == [
        s["json"] for u in urls for s in iter_shard(u)]
    assert "wrote 60 samples" in capsys.readouterr().out


def test_shards_write_reports_errors(tmp_path: Path, capsys):
    bad = tmp_path / "x.csv"
    bad.write_text("a")
    assert run(["shards", "write", str(bad), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "suffix '.csv'" in capsys.readouterr().err
    assert run(["shards", "ls", str(tmp_path / "none")]) == 2


def test_module_entry_point(tmp_path: Path):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    proc = subprocess.run([sys.executable, "-m", "rlbuffers.cli.shards", "shards", "write",
                           str(src), "--out", str(tmp_path / "o"), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1 samples into 1 shards" in proc.stdout


def test_shards_write_refuses_a_missing_path(tmp_path: Path, capsys):
    real = tmp_path / "a.jsonl"
    real.write_text('{"text": "one"}\n')
    out = tmp_path / "out"
    assert run(["shards", "write", str(real), str(tmp_path / "typo.jsonl"), "--out", str(out),
                "--no-progress"]) == 2
    assert "typo.jsonl" in capsys.readouterr().err and not out.exists()
