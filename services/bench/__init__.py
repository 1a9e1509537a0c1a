"""`prfaas bench`: an OpenAI streaming benchmark client.

workloads (what to send), arrivals (when), client (send and time it), stats (vLLM's metric
definitions), report (table, JSON, plots), cli (`bench_main`, the `prfaas bench` command);
sockets (exact reads on a blocking socket, for the link benchmarks).
"""
