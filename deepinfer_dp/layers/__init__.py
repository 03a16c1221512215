"""Building blocks of the models: paged attention, rotary embedding, RMSNorm."""
