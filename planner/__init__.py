"""Cluster sizing for disaggregated serving: how many prefill and decode replicas a load needs
to meet its TTFT / TPOT SLOs, from cost models fitted to this project's measurements.

    calibration.py   prefill ms vs prompt tokens, decode step ms vs batch and context, KV
                     handoff bytes and rate: fitted from bench/results JSON or given points
    model.py         the queueing model (prefill: M/G/c; decode: batch capacity under the TPOT
                     bound) and the search for the smallest xPyD shape
    simulate.py      discrete-event simulation of colocated or xPyD replicas replaying a trace
    fit.py           the serving path's own costs, fitted from closed-loop benchmark runs
    replay.py        traces in the serving benchmark's format, and the benchmark's figures
    search.py        the shape search on the simulator, started from the queueing model's answer

`splitserve plan` (splitserve_cli/plan.py) is the command line.
"""
