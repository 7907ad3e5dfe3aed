"""Array-backed segment trees (sum and min) with vectorised update and prefix-sum search,
as used by proportional prioritized replay (Schaul et al., 2016, Appendix B.2.1)."""

from __future__ import annotations

import numpy as np

from rlbuffers import ranges

#: Prefix searches find their node at this depth of the tree (``2**TOP_DEPTH`` nodes, stored
#: contiguously) with one ``np.searchsorted`` in the running sum of that level, and descend
#: only the levels below it: the descent costs ~5 numpy calls per level for all searches
#: together (~5 us for a batch of 256), the running sum of 4,096 nodes ~5 us in all (issue 33:
#: 17 levels at 131,072 leaves become 5; 15 at 32,768 become 3).
TOP_DEPTH = 12


class SegmentTree:
    """A complete binary tree over ``capacity`` leaves combining children with ``op``.

    Leaves live at ``tree[n + i]`` (``n`` = capacity rounded up to a power of two); node ``k``
    holds ``op(tree[2k], tree[2k + 1])``; the root is ``tree[1]``. Updates of ``m`` leaves cost
    O(m log n) numpy work; queries of ``m`` prefix sums cost O(log n) vectorised steps.
    """

    def __init__(self, capacity: int, op: np.ufunc, neutral: float) -> None:
        self.capacity = capacity
        self.n = 1 << max(0, (capacity - 1).bit_length())
        self.op, self.neutral = op, neutral
        self.tree = np.full(2 * self.n, neutral, dtype=np.float64)

    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (int64[m]) to ``values`` (float64[m]) and refresh their ancestors."""
        i = np.asarray(idx, dtype=np.int64) + self.n
        self.tree[i] = values
        i = np.unique(i >> 1)
        while len(i) and i[-1] >= 1:
            self.tree[i] = self.op(self.tree[2 * i], self.tree[2 * i + 1])
            if i[0] == 1:
                break
            i >>= 1  # still sorted: drop repeats without np.unique's sort
            i = i[np.concatenate(([True], i[1:] != i[:-1]))]

    def rebuild(self, leaves: np.ndarray) -> None:
        """Set all leaves at once (float64[capacity]) in O(n)."""
        self.tree[:] = self.neutral
        self.tree[self.n : self.n + len(leaves)] = leaves
        k = self.n
        while k > 1:
            k //= 2
            self.tree[k : 2 * k] = self.op(
                self.tree[2 * k : 4 * k : 2], self.tree[2 * k + 1 : 4 * k : 2]
            )

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Leaf values at ``idx``."""
        return self.tree[np.asarray(idx, dtype=np.int64) + self.n]

    @property
    def root(self) -> float:
        """``op`` over all leaves."""
        return float(self.tree[1])

    def find_prefix(self, mass: np.ndarray) -> np.ndarray:
        """For a sum tree of leaves >= 0: the leaf ``i`` with ``sum(leaves[:i]) <= mass <
        sum(leaves[:i+1])``.

        Where the root is positive and finite and every mass is >= 0, each search first finds
        its node at depth ``d = min(TOP_DEPTH, log2(n))`` from ``cs``, the running sum of
        that level's nodes: the first node ``b`` with ``mass < cs[b]`` (``np.searchsorted``),
        so ``cs[b] > cs[b - 1]`` and the node is positive; the search goes on below it with
        ``mass - cs[b - 1]`` (>= 0). A mass at or past ``cs[-1]`` (the root may round
        differently) is searched as the largest float below ``cs[-1]``, in the last positive
        node.

        From there (from the root otherwise) all ``m`` searches descend together, one
        vectorised step per level. At each node the search goes right iff ``(mass >= left and
        right > 0) or left <= 0`` (then ``mass -= left``); the tests on zeros keep float
        rounding from ending on a zero leaf. Below a positive node with every mass >= 0, a
        first pass tests only ``mass >= left``: it differs from the full rule only by entering
        a zero subtree (``right`` is 0), and then ends on a zero leaf; only if some search does
        is the full rule run. Every visited node is then positive and every mass >= 0, so
        ``left <= 0`` implies ``mass >= left`` and ``right > 0``: that test is left out. Same
        leaves, fewer numpy calls. Where the C extension is built, both steps run in one call
        (:data:`rlbuffers.ranges.prefix_search`: a search at a time with the full rule, the
        same floating-point operations in the same order, so the same leaves).

        The running-sum step needs that level to sum to a value > 0 (it does in a tree of
        finite leaves >= 0 with a positive root): where it sums to NaN or <= 0 (the tree's
        nodes were set to something else than such sums), no node of the level would be
        found, so both paths search from the root instead, as they do where the root or a mass
        is out of range.

        Args:
            mass: float64[m] in ``[0, root)``.

        Returns:
            int64[m] leaf indices, each in ``[0, n)`` whatever the tree and the masses; never a
            zero-valued leaf while the root is positive and the tree holds the sums of finite
            leaves >= 0.
        """
        mass = np.array(mass, dtype=np.float64).ravel()  # a copy: updated in place below
        if not (0 < self.tree[1] < np.inf and (len(mass) == 0 or mass.min() >= 0)):
            return self._from_root(mass)
        first = self._top_first()
        if ranges.prefix_search is not None:  # the same two steps in C, one call
            out = np.empty(len(mass), dtype=np.int64)
            try:
                ranges.prefix_search(self.tree, first, mass, out)
            except ValueError:  # the one it can raise here: the level does not sum > 0
                if self._level_sums_above_zero(first):
                    raise
                return self._from_root(mass)
            return out
        with np.errstate(invalid="ignore", over="ignore"):  # quiet as C: inf - inf, 1e308 * 2
            nodes = self._top(mass, first)
            if nodes is None:
                return self._from_root(mass)
            leaves = self._descend(mass.copy(), nodes.copy(), right_test=False, left_test=False)
            if len(leaves) == 0 or self.tree.take(leaves + self.n).min() > 0:
                return leaves
            return self._descend(mass, nodes, right_test=True, left_test=False)

    def _top_first(self) -> int:
        """The first node at depth ``min(TOP_DEPTH, log2(n))`` (also that level's node count)."""
        return 1 << min(TOP_DEPTH, self.n.bit_length() - 1)

    def _level_sums_above_zero(self, first: int) -> bool:
        """Whether the running sum of the nodes ``[first, 2 first)`` ends above 0 (not NaN),
        computed as the running-sum step computes it (``np.cumsum``, a sum at a time)."""
        with np.errstate(invalid="ignore", over="ignore"):
            return bool(np.cumsum(self.tree[first : 2 * first])[-1] > 0)

    def _from_root(self, mass: np.ndarray) -> np.ndarray:
        """The leaves that ``mass`` (float64[m], updated in place) reaches from the root with
        the full rule: the search for any tree and masses (in ``[0, n)`` whatever they are;
        NaN and infinite values give no warning, as in C)."""
        with np.errstate(invalid="ignore", over="ignore"):
            return self._descend(mass, np.ones(len(mass), dtype=np.int64), right_test=True,
                                 left_test=True)

    def _top(self, mass: np.ndarray, first: int) -> np.ndarray | None:
        """The nodes at depth ``min(TOP_DEPTH, log2(n))`` (``first`` of them, from node
        ``first``) that ``mass`` (float64[m] >= 0, root positive; updated in place to the mass
        left below each node) falls in; ``None`` (``mass`` untouched) where that level's
        running sum ends at NaN or <= 0: no node to find."""
        cs = np.cumsum(self.tree[first : 2 * first])
        if not cs[-1] > 0:
            return None
        np.minimum(mass, np.nextafter(cs[-1], 0.0), out=mass)
        b = np.searchsorted(cs, mass, side="right")
        np.subtract(mass, cs.take(b - 1), out=mass, where=b > 0)
        return b + first

    def _descend(self, mass: np.ndarray, i: np.ndarray, *, right_test: bool,
                 left_test: bool) -> np.ndarray:
        """The leaves that ``mass`` (float64[m], updated in place) reaches from nodes ``i``
        (int64[m], one depth; updated in place), going right where ``mass >= left`` [``and
        right > 0``] [``or left <= 0``]."""
        tree, right_of = self.tree, self.tree[1:]  # right_of[k] = tree[k + 1]
        levels = self.n.bit_length() - int(i[0]).bit_length() if len(i) else 0
        for _ in range(levels):
            i <<= 1  # the left child
            left = tree.take(i)
            go_right = mass >= left
            if right_test:
                go_right &= right_of.take(i) > 0
            if left_test:
                go_right |= left <= 0
            np.subtract(mass, left, out=mass, where=go_right)
            i += go_right
        return i - self.n
