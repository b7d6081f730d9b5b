"""The bus between collectors and the engine: Kafka topics, clients and message decoding."""
