"""The points service (consumer side); its ledger and handler land with the consumer."""
