"""The planner: `python -m expframe.plan` predicts step time, memory and scaling of an
experiment on N devices from its measured step and a catalogue of published hardware.

catalogue.py + hardware.json   device types (published, cited) and this machine (measured)
measure.py                     FLOPs, parameter/slot/activation bytes of the traced train step
model.py                       step time (compute and HBM roofs), the step's collectives, memory
anchors.py + anchors.json      published ResNet-50 measurements; the fit of the device model
planner.py                     footprint + hardware + stated inputs -> rows
table.py                       the table and the JSON
"""
