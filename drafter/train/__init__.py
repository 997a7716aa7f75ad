"""The drafter and its training: the EAGLE-3 model in one file (model) and its MLA draft layer's
attention (mla), the block drafters DSpark and DFlash in one file (dspark) and their training
objective (dspark_objective), the training-time
test unroll (ttt) and its later steps' attention merge (merge), the loss, its kinds and lm_head
fused with it (losses), the optimizer (optim), the train step and device setup
(trainer), the batches (batches), the data trained a chunk at a time (chunks) within the run's
disk budget (budget), checkpoints (checkpoint), metrics (metrics), the GPU memory of a step
(memory), and the compile caches that make a first step fast (aot, precompile)."""
