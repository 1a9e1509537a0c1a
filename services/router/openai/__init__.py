"""router/openai"""
