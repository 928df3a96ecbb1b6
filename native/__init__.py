"""The kernels: C++ (`native/csrc`, built into `native._C`), their dispatch (`native.ops`), the
plain-torch twin of every op (`native.reference`), and the one switch between them
(`native.switch`). Knows no model: tensors in, tensors out."""
