"""Bytes of 1M Atari transitions (uint8 [4, 84, 84] stacks, next_obs too) with and without
frame-stack deduplication, computed from the field specs (nothing is filled).

    python -m tools.bench.framestack_bytes [--transitions N] [--episode-length L]

Deduplicated (``FieldSpec(stack_axis=0)`` + ``next_of``): one 84x84 frame per transition, plus
per episode its first stack's 3 earlier frames (``_head_obs``) and its last next frame
(``_final_obs``), plus the working tier's ragged index (start, length: int64 each per slot per
ragged column). Naive: whole stacks for ``obs`` and ``next_obs``.
"""

from __future__ import annotations

import argparse

from rlbuffers import FieldSpec


def sizes(n: int, episode_length: int) -> dict[str, int]:
    """Bytes of ``n`` transitions in episodes of ``episode_length`` transitions."""
    obs = FieldSpec((4, 84, 84), "uint8", stack_axis=0)
    episodes = -(-n // episode_length)
    frames = n * obs.column.item_bytes
    heads = episodes * (obs.stack - 1) * obs.column.item_bytes
    finals = episodes * obs.column.item_bytes
    index = 2 * 2 * 8 * n  # two ragged columns, start + length int64 per slot
    return {"frames": frames, "heads": heads, "finals": finals, "ragged_index": index,
            "deduplicated": frames + heads + finals + index,
            "naive_obs": n * obs.item_bytes, "naive_obs_and_next_obs": 2 * n * obs.item_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transitions", type=int, default=1_000_000)
    p.add_argument("--episode-length", type=int, default=1_000)
    a = p.parse_args()
    for key, b in sizes(a.transitions, a.episode_length).items():
        print(f"{key:24s} {b:>16,d} bytes  {b / 1e9:8.2f} GB")


if __name__ == "__main__":
    main()
