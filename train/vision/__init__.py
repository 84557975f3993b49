"""Image classification on the shared loop: models, data sets, the trainer."""
