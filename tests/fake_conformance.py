"""A stand-in for the conformance matrix's entry point, for benchmarks/gpu_check.py's
logic test: `run_target(target)` returns rows of the shape gpu_check prints."""


def run_target(target: str) -> list:
    return [{"combination": f"classification {target} x1 float32", "result": "runs", "agreement": "max |diff| 0"},
            {"combination": f"d4pg {target} x1 mixed_float16", "result": "refused", "agreement": "exit 2"}]
