"""config.yaml -> frozen, validated dataclasses; every knob declared once with its
default."""
