"""The planner's input bound: where the host's CPU cores, not the devices, set the speed.

A host's CPU preprocesses the images of the devices it holds. At a measured per-core rate
(input_rate.json: ImageNet's train preprocessing on one core) and the cores of the
catalogue's reference host (hardware.json `host_cpu`),

    input seconds per step per host = images per host per step
                                      / (host cores x images/s per core x host_core_factor)

tf.data's prefetch hides it under the device step; where it is longer, the step is bound
by input (model.input_time), and the cores that would keep up are the host's images per
device step over the per-core rate. Those beyond the host's, per host, are what tf.data
service workers on other machines would have to add.

Where the rate applies (`choose`): the rate was measured on ImageNet's JPEG decoding and
augmentation, so it is the default only for an image-classification experiment whose
train input is `imagenet_input` on real data (ClassificationTask.dataset =
@imagenet_input, not use_mock), planned on a device whose host CPU is known. Everything
else keeps the assumption that the input keeps up (D4PG's replay, SN-GAN's centre crops,
synthetic or mock data, this machine, a datasheet without a host), unless
--input_us_per_example states the time, which is used as given everywhere. The factor
(--host_core_factor, default 1.0) states how a reference host's core compares with the
core the rate was measured on. Plain Python.
"""

import dataclasses
from typing import Dict, Optional

from expframe.plan import input_rate
from expframe.plan.catalogue import Hardware

IMAGENET = "imagenet_input"


@dataclasses.dataclass(frozen=True)
class InputChoice:
    """The input a plan charges: a stated time (s_per_example, host seconds per example over
    the host's cores) or a predicted one (core_s_per_example, over the host's cores), or
    neither; `note` says which and why, for the lines under the table."""
    s_per_example: float
    core_s_per_example: float
    note: str
    predicted: bool
    rate: Optional[input_rate.InputRate] = None
    host_core_factor: float = 1.0

    def as_dict(self) -> Dict:
        out = {"predicted": self.predicted, "stated_s_per_example": self.s_per_example,
               "core_s_per_example": self.core_s_per_example, "host_core_factor": self.host_core_factor,
               "note": self.note}
        if self.rate is not None:
            out.update(images_per_sec_per_core=self.rate.images_per_sec_per_core, cpu=self.rate.cpu,
                       source=self.rate.source, rate_file=self.rate.path)
        return out


def keeps_up_reason(settings: Dict, hw: Hardware) -> Optional[str]:
    """Why the measured rate does not apply to this experiment on `hw` (None: it applies)."""
    if settings.get("train_input") != IMAGENET:
        return ("its train input is not imagenet_input's JPEG decoding, the only input whose rate is measured "
                "(expframe/plan/input_rate.json)")
    if settings.get("mock_input"):
        return "mock ImageNet (imagenet_input.use_mock): small random images held in memory"
    if hw.shared_compute:
        return "on this machine the input shares the cores the step runs on, and its measured step includes it"
    if not hw.host_cores_per_device:
        return f"the host CPU of {hw.name} is not known (a datasheet without host_cpu; --host_cores_per_device)"
    return None


def choose(settings: Dict, hw: Hardware, stated_us: Optional[float] = None, host_core_factor: float = 1.0,
           rate: Optional[input_rate.InputRate] = None) -> InputChoice:
    """The input of a plan: `stated_us` (--input_us_per_example) where given; else the
    measured rate (`rate`, default input_rate.json) over the host's cores where
    `keeps_up_reason` finds none; else none (the input keeps up)."""
    if stated_us is not None:
        if not stated_us:
            return InputChoice(0.0, 0.0, "assumed to keep up (--input_us_per_example=0)", False)
        return InputChoice(stated_us * 1e-6, 0.0, f"{stated_us:g} us of host time per example, hidden by prefetch "
                           "up to the device step", False, host_core_factor=host_core_factor)
    reason = keeps_up_reason(settings, hw)
    if reason:
        return InputChoice(0.0, 0.0, f"assumed to keep up: {reason} (--input_us_per_example states it)", False)
    rate = rate or input_rate.load()
    per_core = rate.images_per_sec_per_core * host_core_factor
    note = (f"predicted: ImageNet's train preprocessing at {rate.images_per_sec_per_core:g} images/s per core "
            f"x host_core_factor {host_core_factor:g} = {per_core:g} (measured on {rate.cpu}; "
            f"{input_rate.shown(rate.path)}), on the host's CPU ({hw.host_cpu or 'stated'}: "
            f"{hw.host_cores_per_device:g} cores per device); input per step per host = its images / (its cores x "
            "that rate), hidden by prefetch up to the device step; --input_us_per_example states it instead")
    return InputChoice(0.0, 1.0 / per_core, note, True, rate, host_core_factor)

