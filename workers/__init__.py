"""Ray side of execution: tensor-parallel ranks as actors, their process group, placement
and the executor the engine uses for tensor_parallel_size > 1."""
