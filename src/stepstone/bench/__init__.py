"""`stepstone bench`: workloads measured against a baseline taken in the same run.

One module per workload (ceiling, throughput, latency, enqueue, scale, recovery, memory); `common`
holds the database, sizes and statistics they share, `workflows` the workflows they run, `runner`
the table and the JSON report. Numbers are reported, never asserted: CI asserts structure in
tests/perf/ instead.
"""
