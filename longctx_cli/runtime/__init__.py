"""What train and eval share on a rank: distributed init, batches, model building, the
head and its loss. Imports parallel, data and config; never train or eval."""
