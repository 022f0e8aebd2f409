"""Byte automata: an IR tree becomes an NFA, determinized lazily into a DFA over bytes.

:meth:`Automaton.from_ir` builds a Thompson-style NFA (epsilon edges and byte-range edges;
alternatives of plain byte sequences, such as UTF-8 character classes, share their common
suffixes) and trims every state that cannot reach acceptance, so any live state can still
complete the output. Bounded repetitions are expanded into copies, so the NFA's size is
estimated first and a constraint over :data:`MAX_NFA_STATES` is refused. The DFA is built on demand by subset construction: a DFA state is the set of NFA
states that have a byte edge (plus the accepting state) reachable by epsilon edges, interned
to an ``int``. A state's row of the transition table (:attr:`Automaton.table`, ``int32``
``[states, 256]``) is filled the first time any of its transitions is needed, all 256 bytes at
once (grouping bytes that lead to the same NFA states), which is far cheaper than filling
single entries. Only the states that generation (and its token masks) reach are ever built,
so a pattern whose full DFA would be exponential costs only what is visited (about 1 KiB of
table per state).

State :data:`DEAD` (``0``) is the empty set: no output continues from it, and its row maps
every byte back to it. :data:`UNKNOWN` marks the entries of rows not filled yet.

A DFA state stands for up to the whole NFA, so one new state can cost work in proportion to
the NFA's size, and a walk can meet many such states. That work is counted in NFA states
touched (see :class:`WorkMeter`) and charged to :attr:`Automaton.meter` when one is set:
past its budget, :class:`WorkBudgetExceeded` is raised. States built until then stay valid.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Generator, Sequence

import numpy as np

from chassis.builtin_plugins.structured_output import ir
from chassis.core.structured_output import ConstraintBudgetExceeded

__all__ = [
    "DEAD",
    "MAX_NFA_STATES",
    "UNKNOWN",
    "Automaton",
    "WorkBudgetExceeded",
    "WorkMeter",
    "estimated_nfa_states",
]

#: the dead DFA state: nothing more can match
DEAD = 0
#: a table entry whose row has not been filled yet
UNKNOWN = -1
#: the largest NFA :meth:`Automaton.from_ir` builds by default (bounded repetitions copy
#: their item, so nested bounds multiply)
MAX_NFA_STATES = 200_000

#: the levels of compound IR nodes the NFA build walks by recursion (fast, a frame each)
#: before its explicit stack takes over: bounds its frames whatever the IR's depth
BUILD_RECURSION_DEPTH = 40

_Ranges = tuple[tuple[int, int], ...]
#: the steps of building one compound node: yields (child, entry), is sent the child's exit
_Build = Generator[tuple[ir.Node, int], int, int]


class WorkBudgetExceeded(ConstraintBudgetExceeded):
    """Building DFA states for one constraint took more work than its :class:`WorkMeter`
    allows."""


class WorkMeter:
    """A budget of determinization work, in NFA states touched: each state visited while
    computing an epsilon closure, each NFA state in the sets merged into a new DFA state, and
    each NFA byte edge read while filling a row of the transition table. Deterministic (the
    same constraint, vocabulary and cache contents cost the same), and roughly proportional
    to time.

    :meth:`charge` raises :class:`WorkBudgetExceeded` once :attr:`used` passes ``budget``.
    A single charge is at most the NFA's size, so the work done is at most ``budget`` plus
    one NFA's worth. ``budget=None`` counts without a limit.
    """

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.used = 0

    def charge(self, units: int) -> None:
        self.used += units
        if self.budget is not None and self.used > self.budget:
            raise WorkBudgetExceeded(
                f"building this constraint's automaton took more than its work budget of "
                f"{self.budget} NFA states touched (it is too tangled to enforce: simplify "
                "nested alternatives and bounded repetitions, or raise "
                "CHASSIS_STRUCTURED_OUTPUT_WORK_BUDGET)"
            )


_SINGLE_BYTES: list[_Ranges] = [((b, b),) for b in range(256)]


class _Nfa:
    """A Thompson-style NFA under construction, as flat edge lists (few Python objects, so
    large NFAs build fast): epsilon edges ``eps_from[i] -> eps_to[i]`` and byte edges
    ``edge_from[i] -> edge_to[i]`` on the byte ranges ``edge_ranges[i]``.

    :meth:`build` adds a fragment starting at an existing state and returns its exit. A
    fragment adds edges out of its entry but never into it (loops get a fresh state), which
    is what lets the options of an alternative share their entry.
    """

    def __init__(self) -> None:
        self.size = 0
        self.eps_from: list[int] = []
        self.eps_to: list[int] = []
        self.edge_from: list[int] = []
        self.edge_ranges: list[_Ranges] = []
        self.edge_to: list[int] = []
        self._ranges_of: dict[frozenset[int], _Ranges] = {}
        self._chains: dict[int, list[tuple[_Ranges, ...]] | None] = {}
        self._plans: dict[int, _ChainPlan] = {}
        #: levels of compound IR nodes :meth:`build` builds by recursion, a Python frame
        #: each, before :meth:`build_iteratively` takes over (0: no recursion at all)
        self.recursion_depth = BUILD_RECURSION_DEPTH

    def new(self, count: int = 1) -> int:
        """``count`` new states; returns the first."""
        self.size += count
        return self.size - count

    def link(self, source: int, target: int) -> None:
        self.eps_from.append(source)
        self.eps_to.append(target)

    def edge(self, source: int, ranges: _Ranges, target: int) -> None:
        self.edge_from.append(source)
        self.edge_ranges.append(ranges)
        self.edge_to.append(target)

    def ranges(self, allowed: frozenset[int]) -> _Ranges:
        ranges = self._ranges_of.get(allowed)
        if ranges is None:
            ranges = self._ranges_of[allowed] = _to_ranges(allowed)
        return ranges

    def chains(self, node: ir.Alt) -> list[tuple[_Ranges, ...]] | None:
        """The options of ``node`` as sequences of byte ranges if all are fixed-length
        byte sequences (as UTF-8 character classes are), else ``None`` (memoized by id)."""
        if id(node) not in self._chains:
            self._chains[id(node)] = _chains(node, self.ranges)
        return self._chains[id(node)]

    def estimate(self, node: ir.Node, memo: dict[int, int] | None = None) -> int:
        """An upper bound of the states :meth:`build` adds for ``node``, without building
        (memoized by ``id``: IR trees share sub-trees, and a deep tree's hash is not cached).
        Iterative, so any depth of tree is estimated."""
        memo = {} if memo is None else memo
        stack: list[tuple[ir.Node, bool]] = [(node, False)]
        while stack:
            current, children_done = stack.pop()
            if id(current) in memo:
                continue
            children = self._children(current)
            if not children_done and any(id(child) not in memo for child in children):
                stack.append((current, True))
                stack.extend((child, False) for child in children if id(child) not in memo)
                continue
            memo[id(current)] = self._size(current, memo)
        return memo[id(node)]

    def _children(self, node: ir.Node) -> tuple[ir.Node, ...]:
        """The sub-trees whose sizes :meth:`_size` reads for ``node``."""
        if isinstance(node, ir.Seq):
            return node.items
        if isinstance(node, ir.Alt):
            return node.options if self.chains(node) is None else ()
        if isinstance(node, ir.Repeat):
            return (node.item,) if node.separator is None else (node.item, node.separator)
        if isinstance(node, ir.Separated):
            return (*(item for item, _ in node.items), node.separator)
        return ()

    def _size(self, node: ir.Node, memo: dict[int, int]) -> int:
        """:meth:`estimate` of ``node``, its children's already in ``memo``."""
        if isinstance(node, ir.Bytes):
            return len(node.value)
        if isinstance(node, ir.ByteSet):
            return 1
        if isinstance(node, ir.Seq):
            return sum(memo[id(item)] for item in node.items)
        if isinstance(node, ir.Alt):
            chains = self.chains(node)
            if chains is None:
                return 1 + sum(memo[id(option)] for option in node.options)
            return 1 + len({chain[k:] for chain in chains for k in range(1, len(chain))})
        if isinstance(node, ir.Repeat):  # (see _repeat_steps)
            copies = max(node.min, 1) if node.max is None else node.max
            if node.separator is None:
                return 1 + copies * memo[id(node.item)]
            return 3 + copies * (memo[id(node.item)] + memo[id(node.separator)])
        if isinstance(node, ir.Separated):  # (see _separated_steps)
            items = sum(memo[id(item)] for item, _ in node.items)
            return 1 + items + len(node.items) * (2 + memo[id(node.separator)])
        raise TypeError(f"not an IR node: {node!r}")

    def build(self, node: ir.Node, entry: int) -> int:
        """Add a fragment matching ``node`` from state ``entry``; returns its exit state.

        Any depth of tree builds, in a bounded number of Python frames: the top
        :attr:`recursion_depth` levels of compound nodes by recursion (the fast path), the
        subtrees below them by :meth:`build_iteratively`, which makes the same states and
        edges in the same order."""
        return self._build(node, entry, 0)

    def _build(self, node: ir.Node, entry: int, depth: int) -> int:
        # (the leaves first, inline: most nodes are leaves, and a call each costs)
        if isinstance(node, ir.Bytes):
            cur = entry
            for byte in node.value:
                nxt = self.new()
                self.edge(cur, _SINGLE_BYTES[byte], nxt)
                cur = nxt
            return cur
        if isinstance(node, ir.ByteSet):
            end = self.new()
            ranges = self.ranges(node.allowed)
            if ranges:  # an empty set is no edge: the fragment matches nothing
                self.edge(entry, ranges, end)
            return end
        if depth >= self.recursion_depth:
            return self.build_iteratively(node, entry)
        depth += 1
        if isinstance(node, ir.Seq):
            cur = entry
            for item in node.items:
                cur = self._build(item, cur, depth)
            return cur
        if isinstance(node, ir.Alt):
            if self.chains(node) is not None:
                return self._chain_alt(node, entry)
            end = self.new()
            for option in node.options:
                self.link(self._build(option, entry, depth), end)
            return end
        if isinstance(node, ir.Repeat | ir.Separated):
            steps = self._steps(node, entry)
            built: int | None = None
            while True:
                try:
                    child, child_entry = steps.send(built)
                except StopIteration as done:
                    return done.value
                built = self._build(child, child_entry, depth)
        raise TypeError(f"not an IR node: {node!r}")

    def build_iteratively(self, node: ir.Node, entry: int) -> int:
        """:meth:`build` without recursion (the reference path, and the one for deep
        subtrees): a leaf is built at once; a ``Seq``, ``Alt`` or ``Repeat`` is a generator
        (:meth:`_compound`) that builds its leaf children itself and yields each compound
        ``(child, entry)`` to build, is sent back the child's exit, kept on an explicit
        stack."""
        exit_state = self._leaf(node, entry)
        if exit_state is not None:
            return exit_state
        stack = [self._compound(node, entry)]
        sent: int | None = None
        while True:
            try:
                child, child_entry = stack[-1].send(sent)
            except StopIteration as done:
                stack.pop()
                if not stack:
                    return done.value
                sent = done.value
                continue
            stack.append(self._compound(child, child_entry))  # (leaves are built there)
            sent = None

    def _leaf(self, node: ir.Node, entry: int) -> int | None:
        """Build a ``Bytes`` or ``ByteSet`` from ``entry`` and return its exit (``None``
        for another node)."""
        if isinstance(node, ir.Bytes):
            cur = entry
            for byte in node.value:
                nxt = self.new()
                self.edge(cur, _SINGLE_BYTES[byte], nxt)
                cur = nxt
            return cur
        if isinstance(node, ir.ByteSet):
            end = self.new()
            ranges = self.ranges(node.allowed)
            if ranges:  # an empty set is no edge: the fragment matches nothing
                self.edge(entry, ranges, end)
            return end
        if isinstance(node, ir.Alt) and self.chains(node) is not None:
            return self._chain_alt(node, entry)
        return None

    def _compound(self, node: ir.Node, entry: int) -> _Build:
        """The steps of building a ``Seq``, ``Alt`` or ``Repeat`` (see
        :meth:`build_iteratively`): its leaf children are built here at once, compound ones
        are yielded."""
        leaf = self._leaf
        if isinstance(node, ir.Seq):
            cur = entry
            for item in node.items:
                out = leaf(item, cur)
                cur = (yield item, cur) if out is None else out
            return cur
        if isinstance(node, ir.Alt):  # (alternatives of byte chains are leaves)
            end = self.new()
            for option in node.options:
                out = leaf(option, entry)
                self.link((yield option, entry) if out is None else out, end)
            return end
        if isinstance(node, ir.Repeat | ir.Separated):
            steps = self._steps(node, entry)
            built: int | None = None
            while True:
                try:
                    child, child_entry = steps.send(built)
                except StopIteration as done:
                    return done.value
                out = leaf(child, child_entry)
                built = (yield child, child_entry) if out is None else out
        raise TypeError(f"not an IR node: {node!r}")

    def _steps(self, node: ir.Repeat | ir.Separated, entry: int) -> _Build:
        """The steps of building a ``Repeat`` or a ``Separated``, shared by both build
        paths: yields every child ``(child, entry)`` to build, is sent its exit."""
        if isinstance(node, ir.Repeat):
            return self._repeat_steps(node, entry)
        return self._separated_steps(node, entry)

    def _separated_steps(self, node: ir.Separated, entry: int) -> _Build:
        """Two tracks of states, "nothing written yet" (the entry, while every item so far
        was optional) and "something written": each item is built once, from a fresh
        state reached from the first track directly and from the second through a copy of
        the separator; its exit is the second track's next state. An optional item can
        also be skipped on either track."""
        nothing: int | None = entry
        something: int | None = None
        for item, required in node.items:
            item_entry = self.new()
            if nothing is not None:
                self.link(nothing, item_entry)
            if something is not None:
                self.link((yield node.separator, something), item_entry)
            after = self.new()
            self.link((yield item, item_entry), after)
            if not required and something is not None:
                self.link(something, after)
            something = after
            if required:
                nothing = None
        end = self.new()
        for state in (nothing, something):
            if state is not None:
                self.link(state, end)
        return end

    def _repeat_steps(self, node: ir.Repeat, entry: int) -> _Build:
        """The steps of building a ``Repeat``, shared by both build paths: yields every
        child ``(item or separator, entry)`` to build, is sent its exit.

        An unbounded repetition builds its item once more than its ``min`` needs, at most:
        ``x*`` loops on a fresh state; ``x{m,}`` (``m >= 1``) is ``m - 1`` copies then one
        copy whose exit loops back to its entry (the exit is the fragment's exit: it stays
        inside the loop, and whatever follows adds edges out of it, never into it). With a
        separator the loop goes back through one copy of the separator into the same copy
        of the item, so nested separated lists stay linear in size. A bounded one is
        ``max`` copies, the optional ones nested: ``x(x(x)?)?``."""
        item, separator = node.item, node.separator
        low, high = node.min, node.max
        cur = entry
        if high is None:
            for k in range(max(low, 1) - 1):
                if separator is not None and k > 0:
                    cur = yield separator, cur
                cur = yield item, cur
            if separator is None:
                loop = self.new()
                self.link(cur, loop)
                out = yield item, loop
                self.link(out, loop)
                return loop if low == 0 else out
            # item_entry: before the looping copy of the item; before_separator: after an
            # item, before the separator that leads back into item_entry
            item_entry = self.new()
            before_separator = self.new()
            self.link(cur, before_separator if low > 1 else item_entry)
            self.link((yield separator, before_separator), item_entry)
            out = yield item, item_entry
            self.link(out, before_separator)
            if low > 0:
                return out
            end = self.new()
            self.link(entry, end)
            self.link(out, end)
            return end
        for k in range(low):
            if separator is not None and k > 0:
                cur = yield separator, cur
            cur = yield item, cur
        if high == low:
            return cur
        end = self.new()
        for k in range(low, high):  # nested optionals: x(x(x)?)? stays linear
            self.link(cur, end)
            if separator is not None and k > 0:
                cur = yield separator, cur
            cur = yield item, cur
        self.link(cur, end)
        return end

    def _chain_alt(self, node: ir.Alt, entry: int) -> int:
        """An alternative of fixed byte sequences, their common suffixes shared."""
        plan = self._plans.get(id(node))
        if plan is None:
            plan = self._plans[id(node)] = _ChainPlan(self.chains(node))
        # stamp the plan's states: base is the exit, base + i its i-th suffix state
        base = self.new(plan.num_states)
        for i, ranges, j in plan.inner:
            self.edge(base + i, ranges, base + j)
        for ranges, j in plan.first:
            self.edge(entry, ranges, base + j)
        if plan.nullable:
            self.link(entry, base)
        return base


def estimated_nfa_states(node: ir.Node) -> int:
    """An upper bound of the NFA states :meth:`Automaton.from_ir` builds for ``node``,
    without building it (what :data:`MAX_NFA_STATES` is compared with)."""
    return _Nfa().estimate(node)


class _ChainPlan:
    """The states of an alternative of byte sequences whose common suffixes are shared:
    state 0 is the exit, each other state one suffix; ``inner`` holds the edges between
    them as ``(state, ranges, state)``, ``first`` the entry's edges as ``(ranges, state)``,
    ``nullable`` whether the empty sequence is an option."""

    def __init__(self, chains: list[tuple[_Ranges, ...]]) -> None:
        index: dict[tuple[_Ranges, ...], int] = {(): 0}
        self.inner: list[tuple[int, _Ranges, int]] = []
        self.first: list[tuple[_Ranges, int]] = []
        self.nullable = False
        for chain in chains:
            if not chain:
                self.nullable = True
                continue
            for k in range(len(chain) - 1, 0, -1):
                if chain[k:] not in index:
                    index[chain[k:]] = len(index)
                    self.inner.append((index[chain[k:]], chain[k], index[chain[k + 1 :]]))
            self.first.append((chain[0], index[chain[1:]]))
        self.num_states = len(index)


#: the longest byte sequence whose suffixes :class:`_ChainPlan` shares: enough for UTF-8
#: characters (4 bytes) and short literals; sharing suffixes costs memory quadratic in the
#: length, so long alternatives (a choice of long strings) are built as plain alternations
_MAX_SHARED_CHAIN = 8


def _chains(node: ir.Alt, ranges_of: Callable[[frozenset[int]], _Ranges]) -> list | None:
    chains = []
    for option in node.options:
        items = option.items if isinstance(option, ir.Seq) else (option,)
        chain: list[_Ranges] = []
        for item in items:
            if isinstance(item, ir.Bytes):
                chain.extend(((b, b),) for b in item.value)
            elif isinstance(item, ir.ByteSet) and item.allowed:
                chain.append(ranges_of(item.allowed))
            else:
                return None
            if len(chain) > _MAX_SHARED_CHAIN:
                return None
        chains.append(tuple(chain))
    return chains


def _to_ranges(allowed: frozenset[int]) -> _Ranges:
    out: list[tuple[int, int]] = []
    for byte in sorted(allowed):
        if out and out[-1][1] == byte - 1:
            out[-1] = (out[-1][0], byte)
        else:
            out.append((byte, byte))
    return tuple(out)


class Automaton:
    """A byte-level DFA of one IR tree, determinized lazily; see the module docstring.

    States are ``int``: :attr:`start`, :data:`DEAD`, and whatever :meth:`step` returns. Every
    state other than :data:`DEAD` can still reach acceptance. Not thread-safe (the engine
    core uses a grammar from one thread).
    """

    def __init__(self, nfa: _Nfa, nfa_start: int, accept: int) -> None:
        self._accept = accept
        live = _co_reachable(nfa, accept)
        # edges into states that cannot complete are dropped; what remains is stored by
        # source state (CSR: state s's edges are [offsets[s], offsets[s + 1]))
        live_mask = np.array(live, dtype=bool)
        eps_from = np.asarray(nfa.eps_from, dtype=np.int64)
        eps_to = np.asarray(nfa.eps_to, dtype=np.int64)
        keep = live_mask[eps_to]
        self._eps_offsets, (self._eps_to,) = _by_source(nfa.size, eps_from[keep], eps_to[keep])
        edge_to = np.asarray(nfa.edge_to, dtype=np.int64)
        kept = np.flatnonzero(live_mask[edge_to])
        edge_from = np.asarray(nfa.edge_from, dtype=np.int64)[kept]
        self._edge_offsets, (edge_index, self._edge_to) = _by_source(
            nfa.size, edge_from, kept, edge_to[kept]
        )
        self._edge_ranges = [nfa.edge_ranges[i] for i in edge_index]
        self._closures: dict[int, frozenset[int]] = {}
        self._sets: list[frozenset[int]] = [frozenset()]  # DFA state id -> NFA states
        self._ids: dict[frozenset[int], int] = {frozenset(): DEAD}
        self._targets_cache: dict[tuple[int, ...], int] = {}
        self._accepting: list[bool] = [False]
        self._terminal: list[bool] = [False]
        self._table = np.full((64, 256), UNKNOWN, dtype=np.int32)
        self._table[DEAD] = DEAD
        self._filled = np.zeros(64, dtype=bool)
        self._filled[DEAD] = True
        self.nfa_size = nfa.size
        #: where determinization work is charged (``None``: free); set by the caller around
        #: the calls it wants to bound (the engine core: one request's matcher)
        self.meter: WorkMeter | None = None
        self.start = self._intern(self._closure(nfa_start)) if live[nfa_start] else DEAD

    @classmethod
    def from_ir(cls, node: ir.Node, *, max_nfa_states: int = MAX_NFA_STATES) -> Automaton:
        """The automaton of ``node``. Raises ``ValueError`` ("constraint too large") when its
        NFA would exceed ``max_nfa_states`` states (estimated before building anything). The
        NFA is estimated without recursion and built in a bounded number of frames (see
        :meth:`_Nfa.build`), so a tree of any depth works."""
        nfa = _Nfa()
        estimate = nfa.estimate(node)
        if estimate > max_nfa_states:
            raise ValueError(
                f"constraint too large: its automaton needs about {estimate} states, more "
                f"than the limit of {max_nfa_states}; use fewer or shorter choices, fewer "
                "or smaller bounded repetitions (maxLength, maxItems, {m,n}), or less "
                "nesting"
            )
        start = nfa.new()
        accept = nfa.build(node, start)
        return cls(nfa, start, accept)

    # -- queries ---------------------------------------------------------------------------

    @property
    def matches_nothing(self) -> bool:
        """Whether no output at all matches (the start state is :data:`DEAD`)."""
        return self.start == DEAD

    @property
    def num_states(self) -> int:
        """DFA states built so far (including :data:`DEAD`)."""
        return len(self._sets)

    @property
    def table(self) -> np.ndarray:
        """The transition table, ``int32 [capacity, 256]``: :data:`UNKNOWN` in rows not filled
        yet (see :meth:`fill_rows`). Re-read it after filling: growing reallocates it."""
        return self._table

    def is_accepting(self, state: int) -> bool:
        """Whether the output read so far is a complete match."""
        return self._accepting[state]

    def is_terminal(self, state: int) -> bool:
        """Whether ``state`` is accepting and no byte may follow."""
        return self._terminal[state]

    def step(self, state: int, byte: int) -> int:
        """The state after ``byte`` (:data:`DEAD` if it cannot follow)."""
        if not self._filled[state]:
            self._fill_row(state)
        return int(self._table[state, byte])

    def walk(self, state: int, data: bytes) -> int:
        """The state after all of ``data`` (:data:`DEAD` as soon as a byte cannot follow)."""
        for byte in data:
            if state == DEAD:
                break
            state = self.step(state, byte)
        return state

    def fullmatch(self, data: bytes) -> bool:
        """Whether all of ``data`` matches."""
        return self.is_accepting(self.walk(self.start, data))

    def row(self, state: int) -> np.ndarray:
        """The filled transition row of ``state`` (a view of :attr:`table`)."""
        if not self._filled[state]:
            self._fill_row(state)
        return self._table[state]

    def fill_rows(self, states: np.ndarray) -> None:
        """Fill the rows of ``states`` (any that are not filled yet)."""
        for state in np.unique(states).tolist():
            if not self._filled[state]:
                self._fill_row(state)

    # -- construction ----------------------------------------------------------------------

    def _closure(self, nfa_state: int) -> frozenset[int]:
        """The NFA states with a live byte edge, or the accepting state, reachable from
        ``nfa_state`` by epsilon edges (memoized)."""
        known = self._closures.get(nfa_state)
        if known is not None:
            return known
        seen = {nfa_state}
        stack = [nfa_state]
        important = []
        eps_offsets, eps_to, edge_offsets = self._eps_offsets, self._eps_to, self._edge_offsets
        while stack:
            s = stack.pop()
            if edge_offsets[s] < edge_offsets[s + 1] or s == self._accept:
                important.append(s)
            for t in eps_to[eps_offsets[s] : eps_offsets[s + 1]]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        if self.meter is not None:
            self.meter.charge(len(seen))
        result = frozenset(important)
        self._closures[nfa_state] = result
        return result

    def _intern(self, nfa_states: frozenset[int]) -> int:
        state = self._ids.get(nfa_states)
        if state is not None:
            return state
        state = len(self._sets)
        self._sets.append(nfa_states)
        self._ids[nfa_states] = state
        self._accepting.append(self._accept in nfa_states)
        self._terminal.append(
            nfa_states == frozenset((self._accept,))
            and self._edge_offsets[self._accept] == self._edge_offsets[self._accept + 1]
        )
        if state >= len(self._table):
            grown = np.full((2 * len(self._table), 256), UNKNOWN, dtype=np.int32)
            grown[: len(self._table)] = self._table
            self._table = grown
            self._filled = np.concatenate([self._filled, np.zeros(len(self._filled), bool)])
        return state

    def _target(self, targets: list[int]) -> int:
        """The DFA state of the epsilon closure of the NFA states ``targets``."""
        key = tuple(sorted(set(targets)))
        state = self._targets_cache.get(key)
        if state is None:
            if len(key) == 1:
                nfa_states = self._closure(key[0])
            else:
                closures = [self._closure(t) for t in key]
                if self.meter is not None:
                    self.meter.charge(sum(map(len, closures)))
                nfa_states = frozenset().union(*closures)
            state = self._targets_cache[key] = self._intern(nfa_states)
        return state

    def _fill_row(self, state: int) -> None:
        """All 256 transitions of ``state``: split the bytes into intervals on which every
        NFA edge is either on or off, then one DFA target per interval."""
        offsets = self._edge_offsets
        edges = [
            (self._edge_ranges[i], self._edge_to[i])
            for s in self._sets[state]
            for i in range(offsets[s], offsets[s + 1])
        ]
        if self.meter is not None:
            self.meter.charge(len(self._sets[state]) + len(edges))
        cuts = {0, 256}
        for ranges, _ in edges:
            for lo, hi in ranges:
                cuts.add(lo)
                cuts.add(hi + 1)
        bounds = sorted(cuts)
        targets: list[list[int]] = [[] for _ in range(len(bounds) - 1)]
        for ranges, to in edges:
            for lo, hi in ranges:
                for k in range(bisect.bisect_left(bounds, lo), bisect.bisect_left(bounds, hi + 1)):
                    targets[k].append(to)
        row = np.full(256, DEAD, dtype=np.int32)
        for k, interval_targets in enumerate(targets):
            if interval_targets:
                row[bounds[k] : bounds[k + 1]] = self._target(interval_targets)
        # _target may have grown the table: write into the current one
        self._table[state] = row
        self._filled[state] = True


def _co_reachable(nfa: _Nfa, accept: int) -> list[bool]:
    """Which NFA states can reach ``accept`` (following epsilon and byte edges)."""
    offsets, (predecessors,) = _by_source(
        nfa.size, nfa.eps_to + nfa.edge_to, nfa.eps_from + nfa.edge_from
    )
    live = [False] * nfa.size
    live[accept] = True
    stack = [accept]
    while stack:
        s = stack.pop()
        for p in predecessors[offsets[s] : offsets[s + 1]]:
            if not live[p]:
                live[p] = True
                stack.append(p)
    return live


def _by_source(
    size: int, sources: Sequence[int] | np.ndarray, *columns: Sequence[int] | np.ndarray
) -> tuple[array[int], tuple[array[int], ...]]:
    """Group edges by source state: ``offsets`` (``size + 1``) and each column reordered so
    that state ``s``'s entries are ``[offsets[s], offsets[s + 1])``. Compact ``array``s
    (8 bytes an entry) that still index and iterate as Python ints."""
    sources_array = np.asarray(sources, dtype=np.int64)
    order = np.argsort(sources_array, kind="stable")
    offsets = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(np.bincount(sources_array, minlength=size), out=offsets[1:])
    reordered = (np.asarray(c, dtype=np.int64)[order] for c in columns)
    return _compact(offsets), tuple(_compact(c) for c in reordered)


def _compact(values: np.ndarray) -> array[int]:
    return array("q", values.astype(np.int64).tobytes())
