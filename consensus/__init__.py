"""Agreement across the ranks of one pipeline: a pure state machine plus a ring transport.

- `types`: Stream, LocalStatus, Verdict, Ruling, Report
- `state`: RankState, one rank's local view per stream and its applied decision log
- `wire`: RoundMsg, the one message on the ring, and its binary format
- `roles`: Leader (rank 0) and Follower (ranks 1..P-1), the round's logic
- `transport`: the Transport interface and an in-memory ring
- `driver`: RingDriver, a rank's control loop step over a transport
- `audit`, `scenario`, `simulator`, `baseline`, `explore`: checking and measuring it

No torch, no sockets, no threads, no pickle; transports are passed in.
"""

from kvbridge.consensus.codec import RoundMsg, Tally
from kvbridge.consensus.driver import RingDriver, StepResult, run_round
from kvbridge.consensus.roles import Follower, Leader, make_role
from kvbridge.consensus.state import RankState
from kvbridge.consensus.transport import InMemoryRing, Transport
from kvbridge.consensus.types import LocalStatus, ProtocolError, Report, Ruling, Stream, Verdict

__all__ = [
    "Follower",
    "InMemoryRing",
    "Leader",
    "LocalStatus",
    "ProtocolError",
    "RankState",
    "Report",
    "RingDriver",
    "RoundMsg",
    "Ruling",
    "StepResult",
    "Stream",
    "Tally",
    "Transport",
    "Verdict",
    "make_role",
    "run_round",
]
