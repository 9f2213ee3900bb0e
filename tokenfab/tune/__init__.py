"""tokenfab tune: the targets first, then the design space that meets them, measured (docs/tune.md).

`tokenfab tune` takes latency targets (P99 TTFT, P99 TPOT), an optional quality floor (mean KL or
same top-1 against the full-precision model), a workload and a time budget, and finds the serve
configuration that meets them at the highest goodput per core. Modules, in the order a run uses them:

  space.py     the axes and their points; a point's serve flags; the engine's defaults as a point
  targets.py   the targets, and how far a measurement is from each
  workload.py  the workload as `bench serve` flags (or a bench result to replay)
  results.py   the JSON-lines results file a run appends to and resumes from
  quality.py   `quant eval` of a weight format and KV dtype
  measure.py   a server started with a point's flags, one bench run against it, its metrics
  predict.py   the planner's replay of a measured run under other scheduler settings
  search.py    the order of work: quality, baseline, one run per build, then what could win
  report.py    the rich table, the matplotlib plot, the serve config file
  validate.py  consecutive bench runs against `serve --config` of the chosen point
  run.py       the command's handler;  cli.py  its flags
"""
