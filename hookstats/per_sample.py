class PerSampleGradNorms: pass
