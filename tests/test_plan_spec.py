"""The capacity simulator's speculative decoding: each decode scores 1 + k tokens and emits 1 + k*A."""
from tokenfab.costmodel.shape import StepShape
from tokenfab.plan.simulate import SchedulerConfig, simulate
from tokenfab.plan.workload import Request


class UnitCost:
    """Every step takes 1 s, whatever it holds: the step count is the clock."""

    def new_shape(self) -> StepShape:
        return StepShape()

    def step_time(self, shape: StepShape) -> float:
        return 1.0


def run(**spec):
    res = simulate(UnitCost(), [Request(0, 0.0, 32, 101)], SchedulerConfig(**spec))
    return res.requests[0], res


def test_speculation_divides_decode_steps_by_the_expected_accepted_length():
    plain, _ = run()
    spec, res = run(spec_tokens=4, spec_acceptance=0.5)      # 1 + 4 * 0.5 = 3 tokens per decode step
    assert plain.e2e_s == 101                                  # 1 prefill step + 100 decode steps
    assert spec.e2e_s == 1 + 34                                # 100 tokens at 3 per step, the last step short
    assert spec.output_len == 101 and res.num_steps == 35


def test_zero_acceptance_or_a_large_batch_changes_nothing():
    plain, _ = run()
    assert run(spec_tokens=4, spec_acceptance=0.0)[0].e2e_s == plain.e2e_s
    many = [Request(i, 0.0, 32, 50) for i in range(6)]
    base = simulate(UnitCost(), many, SchedulerConfig())
    off = simulate(UnitCost(), many, SchedulerConfig(spec_tokens=4, spec_acceptance=0.9, spec_max_batch_size=4))
    assert off.num_steps == base.num_steps                     # 6 decoding sequences > 4: never speculates
