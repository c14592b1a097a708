"""Forward-only pieces: input models built and loaded (`models`), Megatron's schedule over
micro batches with an objective's sums and the frame of a forward-only stage (`passes`), and
the forwards whose outputs stages keep (`objectives`: token NLL, logits, per-pair log-prob
sums). The training engine builds on them; nothing here imports training code, so editing the
optimizer or the training loop leaves the code identity (and the cached outputs) of
ref_logprobs, teacher_logprobs and eval alone."""
