"""The losses of a distillation: the logit loss (fused, chunked, two-pass) and its gradients, the
loss terms (logit, feature, attention, cosine, MSE), their registry and weights, and the
teacher's top k."""
