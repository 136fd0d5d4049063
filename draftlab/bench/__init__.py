"""The bench stage: servers started in pairs, one client, the offline run, the cost model and the advice, the report and its plots."""
