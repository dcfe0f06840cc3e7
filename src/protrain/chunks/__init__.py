"""chunks"""
