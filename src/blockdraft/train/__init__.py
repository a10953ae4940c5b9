"""DFlash training: batch construction (`batch`), the loss (`loss`) and the training loop (`loop`)."""
