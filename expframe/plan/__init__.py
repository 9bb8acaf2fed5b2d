"""The planner: `python -m expframe.plan` predicts step time, memory and scaling of an
experiment on N devices from its measured step and a catalogue of published hardware.

catalogue.py + hardware.json   device types (published, cited) and this machine (measured)
datasheet.py                   a device described by its datasheet (--hardware=FILE.json)
measure.py                     FLOPs, parameter/slot/activation bytes of the traced train step
model.py                       a plan's row: step time, communication, memory, scaling
device_model.py                one replica's step: two roofs, parameters shared across devices
collective_cost.py             what the step's all-reduces and SyncBatchNorm calls cost
input_rate.py + input_rate.json  ImageNet's train preprocessing per CPU core (measured, its source)
input_bound.py                 where the input is predicted: a host's cores x the rate, or stated
input_table.py                 the cores that feed each device (docs/planning.md's input tables)
anchors.py + anchors.json      published ResNet-50 measurements; the fit of the device model
validation.py + heldout.json   leave one device family out; runs no fit reads
planner.py                     footprint + hardware + stated inputs -> rows
table.py                       the table and the JSON
"""
