"""Worker-side data handling: read raw rows (readers), normalise formats (formats), render
and tokenize chats with a loss mask (tokenize) and pack sequences (packing).

Never imports prefect; the prep stage (`alignflow.job.stages.prep`) puts these together.
"""
