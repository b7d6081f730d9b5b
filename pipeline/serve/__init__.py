"""``rankscope serve``: the online service over a Kafka consumer group."""
