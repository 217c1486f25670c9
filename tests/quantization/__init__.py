"""Tests of ``easykv.quantization``: every quantizer family through write, read and attention."""
