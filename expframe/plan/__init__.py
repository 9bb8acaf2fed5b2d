"""The planner: `python -m expframe.plan` predicts step time, memory and scaling of an
experiment on N devices from its measured step and a catalogue of published hardware.

catalogue.py + hardware.json   device types (published, cited) and this machine (measured)
measure.py                     FLOPs, parameter/slot/activation bytes of the traced train step
model.py                       step time, all-reduce (ring, hierarchical, torus), memory
planner.py                     footprint + hardware + stated inputs -> rows
table.py                       the table and the JSON
"""
