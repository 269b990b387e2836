"""Communication: traced collectives (flight recorder), ring algorithms on P2P, alpha-beta cost model.

    from meshlm.mesh import Layout, ParallelContext
    from meshlm.comm import Comm
    comm = Comm(ParallelContext(Layout(dp=2)))
    comm.all_reduce(grad, "dp")
    print(comm.format_summary())

Modules: traced.py (Comm, Handle), recorder.py (FlightRecorder), ring.py (ring algorithms),
shared_memory.py and gloo_rings.py (what Comm runs on gloo: on one host, across hosts),
cost.py (formulas, Link, Topology, presets, fit), bench.py (`meshlm bench comm`).
"""

from meshlm.comm.cost import HARDWARE, Link, Topology, bus_factor, load_profile, op_time, rank_traffic, steps
from meshlm.comm.recorder import CommRecord, FlightRecorder
from meshlm.comm.traced import P2P, Comm, Handle, ReduceOp

__all__ = ["Comm", "Handle", "P2P", "ReduceOp", "FlightRecorder", "CommRecord", "Link", "Topology", "HARDWARE",
           "bus_factor", "steps", "rank_traffic", "op_time", "load_profile"]
