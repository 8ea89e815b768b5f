"""dropless.bench"""
