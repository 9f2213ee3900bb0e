"""The step-cost model, a leaf that the engine, the planner and the server read.

- `shape.py`    StepShape: what a step computes (tokens, sequences, attention pairs, KV read)
- `measured.py` MeasuredStepCost, fitted to measured step times; NoisyStepCost; step tables and logs
- `online.py`   OnlineStepModel: the engine's MeasuredStepCost, refitted from the steps it runs

It imports no other part of tokenfab, so the engine uses it without pulling in the planner.
"""
