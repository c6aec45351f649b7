"""Pure array functions of the formats: E2M1/E4M3 rounding, scales, packing, SR, Hadamard."""
