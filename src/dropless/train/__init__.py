"""dropless.train: training support (tokenizer, corpus, data, schedule, checkpoint).

Modules take plain arguments, never config objects; the config tree calls them.
"""
