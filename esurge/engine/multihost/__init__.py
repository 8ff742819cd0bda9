"""Multi-host serving: one JAX job over several processes (multi-controller).

Every host runs the same program over one global mesh. The leader (rank 0)
runs the scheduler and the gRPC server; each step it sends its followers the
SchedulerOutput over a TCP step channel before dispatching it, and they
dispatch and collect the same steps in the same order, so the collectives of
every step meet (`lockstep`). A handshake compares a fingerprint of model,
configuration and code (`fingerprint`), and every collected step's sampled
tokens are compared by digest; a follower that leaves or diverges fails the
leader's engine, whose requests then end with an error and whose health
turns NOT_SERVING.
"""
