"""Alert delivery with storage: the outbox of notifications in SQL (`outbox`) and the signed,
retried webhook sender that drains it (`webhooks`). Uses the rule library `alerts` and
`services.storage`; the aggregator's alert loop imports it, never the other way round."""
