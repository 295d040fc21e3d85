"""What train and eval share: distributed init and the parallel layout, batches, the torchrun
launch, model building. Imports parallel, data and config; never train or eval."""
