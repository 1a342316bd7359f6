"""The buffer's credit ledger: who asked for credit, who holds how much, and how much may be admitted.

Not a CLI; used by ``buffer.admission`` (the rules are in its module docstring). Pure
bookkeeping: no sockets, no LMDB, no clock. The caller passes ``now`` (``time.monotonic()`` seconds) and the
admission capacity, and sends the grants and refusals this class returns.

State (in memory by design: a restarted buffer starts with no credit in flight, and groups from old grants
still count when they arrive):

- waiting requests, oldest first: actor id -> (connection identity, credits still wanted);
- credits in flight per actor id: ``[expiry, count]`` per grant, oldest first, and the connection they were
  granted to (``holder``);
- the actor ids each connection waits for or holds credit for (bounds what one connection may take);
- with CurveZMQ, the client key that owns each actor id;
- each actor id's *principal*, the party a fair share belongs to: its client key under CurveZMQ (a per-actor
  key is one actor; the shared ``actor`` key is one party however many ids it asks for), else its connection.

Fair share: the admission bound ``T`` = free capacity + credits in flight, split between the *active*
principals (those waiting for credit or holding some): ``share = max(1, T // active)``. A principal gets
more than its share only while no other principal waits (work-conserving); credit above the share is lent,
and taken back (``reclaim``: it stops counting, as after the ttl) as soon as another principal below its
share waits and the free capacity cannot serve it. Groups made on reclaimed credit are still accepted, so
the staleness bound can be overrun by what was lent, once; a holder that never uses its credit (a key
holder asking for made-up actor ids) cannot keep the run's real actors waiting.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

log = logging.getLogger("vapo.buffer")
MAX_WAITING = 1 << 16  # actors with a deferred credit request


def admission_capacity(max_staleness: int, batch_groups: int, pending_n: int, depth: int, in_flight: int) -> int:
    """Groups that may still be admitted under the staleness bound (see ``buffer.admission``); may be negative.

    ``max_staleness * batch_groups + pending_n - (depth + in_flight)``: ``pending_n`` is the largest
    ``n_groups`` of the waiting batch requests (0 when none waits).
    """
    return max_staleness * batch_groups + pending_n - depth - in_flight


def free_capacity(admission: int, depth_groups: int, depth_bytes: int, in_flight: int,
                  capacity_groups: int, capacity_bytes: int) -> int:
    """What may be granted now: the admission capacity, also capped by the buffer's size limits; >= 0."""
    room = capacity_groups - depth_groups - in_flight
    if depth_bytes >= capacity_bytes:
        room = 0
    return max(0, min(admission, room))


def fair_share(capacity: int, in_flight: int, active: int) -> int:
    """Credit one principal may hold while others wait: the bound (free + in flight) over the active ones, >= 1."""
    return max(1, (capacity + in_flight) // max(1, active))


# Every reason ``CreditLedger.request`` refuses with: clients tell a refused credit request from a refused
# ingest frame by these (an ErrorReply carries no request id).
REFUSAL_REASONS = frozenset({"actor_key", "too_many_actor_ids", "too_many_waiting"})


@dataclass(frozen=True)
class Refusal:
    """A credit request refused: ``reason`` is the metric label and ErrorReply reason."""

    reason: str
    message: str


@dataclass(frozen=True)
class Grant:
    """``n`` credits for ``actor_id``, to be sent to connection ``ident``."""

    ident: bytes
    actor_id: int
    n: int


class CreditLedger:
    """Credit requests and grants of every actor id and ingest connection (see module docstring)."""

    def __init__(self, per_actor: int, per_connection: int, ttl_s: float, max_waiting: int = MAX_WAITING) -> None:
        self.per_actor = per_actor
        self.per_connection = per_connection
        self.ttl_s = ttl_s
        self.max_waiting = max_waiting
        self.released = 0  # credits given back because their connection closed
        self.reclaimed = 0  # credits above a fair share taken back for a principal below its share
        self._in_flight: dict[int, deque[list[float]]] = {}  # actor_id -> [[expiry, count], ...]
        self._waiting: OrderedDict[int, tuple[bytes, int]] = OrderedDict()  # actor_id -> (identity, n)
        self._holder: dict[int, bytes] = {}  # actor_id -> identity its in-flight credits were granted to
        self._actors_of: dict[bytes, set[int]] = {}  # identity -> actor ids it holds or waits credit for
        self._actor_key: dict[int, str] = {}  # actor_id -> CURVE client key that owns it (CurveZMQ only)
        self._principal: dict[int, str] = {}  # actor_id -> the party its fair share belongs to

    # ------------------------------------------------------------------ reading

    @property
    def in_flight(self) -> int:
        """Credits granted and not yet used (nor expired, nor released)."""
        return int(sum(c for q in self._in_flight.values() for _, c in q))

    @property
    def waiting(self) -> int:
        """Actor ids with a deferred request."""
        return len(self._waiting)

    def actor_credit(self, actor_id: int) -> int:
        return int(sum(c for _, c in self._in_flight.get(actor_id, ())))

    def connection_credit(self, ident: bytes) -> int:
        return sum(self.actor_credit(a) for a in self._actors_of.get(ident, ()) if self._holder.get(a) == ident)

    def principal_credit(self) -> dict[str, int]:
        """Credit in flight per principal (those holding none are absent)."""
        held: Counter[str] = Counter()
        for a, q in self._in_flight.items():
            c = int(sum(n for _, n in q))
            if c > 0:
                held[self._principal.get(a, f"actor:{a}")] += c
        return dict(held)

    def share(self, capacity: int) -> int:
        """The fair share now, with ``capacity`` free (module docstring)."""
        active = set(self.principal_credit()) | {self._principal[a] for a in self._waiting}
        return fair_share(capacity, self.in_flight, len(active))

    # ------------------------------------------------------------------ events

    def request(self, ident: bytes, actor_id: int, n: int, key: str | None = None) -> Refusal | None:
        """A ``CreditRequest(actor_id, n)`` from connection ``ident`` (client key ``key`` under CurveZMQ).

        Replaces the actor id's earlier waiting request on this connection; ``n = 0`` withdraws it. Returns
        the refusal to send back, or None (the request now waits, or was a withdrawal).
        """
        if key is not None:
            owner = self._actor_key.setdefault(actor_id, key)
            if owner != key:
                # The actor id's credits (and the groups that use them) belong to another client: refuse.
                return Refusal("actor_key", f"actor_id {actor_id} is bound to another client key (CurveZMQ)")
        waiting = self._waiting.get(actor_id)
        if waiting is not None and waiting[0] == ident:
            del self._waiting[actor_id]
        elif waiting is not None and n == 0:
            return None  # a withdrawal from another connection does not cancel this one's request
        holder = self._holder.get(actor_id)
        if holder is not None and holder != ident and self._in_flight.get(actor_id):
            # A new connection for this actor id means the old process died or reset its socket: its
            # unused grants would otherwise block admission until the ttl (a restarted actor that gets no
            # credit is a deadlock). Groups from those grants are still accepted if they arrive.
            log.info("actor %d reconnected: releasing %d unused credits of its previous connection",
                     actor_id, self.actor_credit(actor_id))
            self._in_flight[actor_id].clear()
        if n == 0:
            return None
        mine = self._live_actors(ident)
        if actor_id not in mine and len(mine) >= self.per_connection:
            # Each waiting actor id needs at least one credit: more ids than the connection may hold
            # credits for can only be a client inventing ids.
            return Refusal("too_many_actor_ids", f"this connection already asks credit for {len(mine)} actor ids "
                           f"(buffer.max_credit_per_connection={self.per_connection})")
        if len(self._waiting) >= self.max_waiting:  # bound memory against a flood of made-up actor ids
            return Refusal("too_many_waiting", f"{self.max_waiting} actors already wait")
        if waiting is not None and waiting[0] != ident:
            del self._waiting[actor_id]  # the actor id moved to this connection
        self._holder[actor_id] = ident
        self._principal[actor_id] = key if key is not None else f"conn:{ident.hex()}"
        mine.add(actor_id)
        self._waiting[actor_id] = (ident, n)
        return None

    def grant(self, capacity: int, now: float) -> list[Grant]:
        """Hand out up to ``capacity`` credits to waiting requests, oldest first, within the per-actor,
        per-connection and fair-share bounds; a partly served request goes to the back of the queue (fair
        between actors). A principal passes its share only while no other principal waits."""
        out: list[Grant] = []
        held = Counter(self.principal_credit())
        waiting_p = Counter(self._principal[a] for a in self._waiting)
        share = fair_share(capacity, self.in_flight, len(set(held) | set(waiting_p)))
        for actor_id in list(self._waiting):
            if capacity <= 0:
                break
            ident, n = self._waiting[actor_id]
            p = self._principal[actor_id]
            room = min(self.per_actor - self.actor_credit(actor_id),
                       self.per_connection - self.connection_credit(ident))
            if len(waiting_p) > 1:  # others wait: no more than the share (alone, it may borrow the rest)
                room = min(room, share - held[p])
            g = min(n, capacity, room)
            if g <= 0:
                continue  # at a bound: waits (in place) until its groups arrive, its credit expires or is reclaimed
            del self._waiting[actor_id]
            capacity -= g
            held[p] += g
            self._in_flight.setdefault(actor_id, deque()).append([now + self.ttl_s, g])
            self._holder[actor_id] = ident
            out.append(Grant(ident, actor_id, g))
            if g < n:
                self._waiting[actor_id] = (ident, n - g)
            else:
                waiting_p[p] -= 1
                if waiting_p[p] <= 0:
                    del waiting_p[p]
        return out

    def reclaim(self, capacity: int) -> int:
        """Take back lent credit (above the fair share) that a waiting principal below its share needs and
        ``capacity`` cannot give; the newest grants go first. Returns the credits that stopped counting."""
        if not self._waiting:
            return 0
        held = self.principal_credit()
        wanted: Counter[str] = Counter()  # what each waiting party could take now, within its other bounds
        for a, (ident, n) in self._waiting.items():
            wanted[self._principal[a]] += max(0, min(n, self.per_actor - self.actor_credit(a),
                                                     self.per_connection - self.connection_credit(ident)))
        share = fair_share(capacity, self.in_flight, len(set(held) | set(wanted)))
        need = sum(min(n, share - held.get(p, 0)) for p, n in wanted.items() if held.get(p, 0) < share) - capacity
        taken = 0
        for p, h in sorted(held.items(), key=lambda kv: kv[1], reverse=True):
            if need - taken <= 0 or h <= share:
                break
            taken += self._take_back(p, min(h - share, need - taken))
        if taken:
            self.reclaimed += taken
            log.info("reclaimed %d credits lent above the fair share (%d) for actors below it", taken, share)
        return taken

    def _take_back(self, principal: str, n: int) -> int:
        """Drop up to ``n`` in-flight credits of ``principal``, newest grants first; returns how many."""
        taken = 0
        for a, q in self._in_flight.items():
            if self._principal.get(a) != principal:
                continue
            while q and taken < n:
                take = min(int(q[-1][1]), n - taken)
                q[-1][1] -= take
                taken += take
                if q[-1][1] <= 0:
                    q.pop()
            if taken >= n:
                break
        return taken

    def consume(self, actor_id: int) -> None:
        """A new group of ``actor_id`` arrived: one of its credits (the oldest grant's) is used."""
        q = self._in_flight.get(actor_id)
        if not q:
            return
        q[0][1] -= 1
        if q[0][1] <= 0:
            q.popleft()

    def expire(self, now: float) -> None:
        """Grants older than the ttl stop counting."""
        for q in self._in_flight.values():
            while q and q[0][0] < now:
                q.popleft()

    def release_connection(self, ident: bytes) -> int:
        """A closed connection: its unused credit and waiting requests stop counting now; returns the credit."""
        released = 0
        for a in self._actors_of.pop(ident, set()):
            w = self._waiting.get(a)
            if w is not None and w[0] == ident:
                del self._waiting[a]
            if self._holder.get(a) == ident:
                released += self.actor_credit(a)
                self._in_flight.pop(a, None)
                del self._holder[a]
        self.released += released
        return released

    def _live_actors(self, ident: bytes) -> set[int]:
        """The actor ids of a connection that still wait for or hold credit there (pruned in place)."""
        ids = self._actors_of.setdefault(ident, set())
        for a in list(ids):
            w = self._waiting.get(a)
            if not ((w is not None and w[0] == ident) or (self._holder.get(a) == ident and self._in_flight.get(a))):
                ids.discard(a)
        return ids
