"""Stand-in for flashinfer 0.7.2's b12x package (tests only; see ../README.md): the part of
`b12x.comm.pcie` and `b12x.preparation` the kernel bench's b12x backends call."""
