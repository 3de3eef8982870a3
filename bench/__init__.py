"""Benchmarks: the scenarios `reprise bench` runs (scenarios.py) against an engine in
this process or a running daemon (targets.py), and the scripts in this folder that
measure one thing each; recorded results are in bench/results/."""
