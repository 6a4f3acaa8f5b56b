"""One candidate's checks, in the order of the flow: surface, build, parity, benchmark, audit, statistics."""
