/* mlensd's configuration: one table of keys, each settable in mlensd.conf
 * (key = value) and as a flag (--key-name); flag > file > default. Unknown
 * keys and bad values are errors naming the key (and the file and line). */
#ifndef MLENS_CONFIG_H
#define MLENS_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* GPUs one daemon may list (the shard plan's limit, daemon/plan/shard.h). */
#define MLENS_CONFIG_MAX_GPUS 64

struct mlens_config {
	char *config;		/* the file read, if any */
	char *model;
	char *socket;
	char *control;
	char *control_group;
	char *stats;
	char *stats_http;
	char *backend;
	char *weight_dtype;	/* "auto" or "fp8": experts quantized at load */
	char *gpu_gemm;		/* "fast" or "exact" (enum mlens_gemm_mode) */
	char *gpu_copy;		/* "engine" or "sm": who moves the compute stream's copies */
	char *gpu_prefill_attention;	/* "auto", "fp32" or "bf16" */
	char *gpu_fp8_gemm;	/* "auto", "fp8" or "dequant": fp8 experts' GEMMs on the GPU */
	char *gpu_copy_out;	/* "compute", "down" or "side": where the activation copies run */
	char *kv_dtype;		/* "auto", "bf16", "fp32" or "fp8": the KV cache's elements */
	char *kv_append;	/* "gpu" or "cpu": who appends K/V to the hybrid pool */
	char *attn_up;		/* "half" or "fp32": the CPU attention's output on its way up */
	char *gpu_sync;		/* "auto", "spin", "yield" or "block": host waits for the GPU */
	int64_t gpu_moe_streams;	/* CUDA streams a MoE call's experts spread over */
	char *gpu_moe_grouped;	/* "auto", "on" or "off": grouped expert GEMMs */
	uint64_t host_memory;		/* host budget, 0: none */
	char *weights_on_disk;		/* "auto", "kv-first" or "never": experts host_memory has no room for stay in the files */
	bool weights_disk_follow;	/* the experts kept in RAM follow the routing */
	uint64_t kv_cache;
	int64_t kv_block_size;
	int64_t kv_growth_room;		/* blocks of growth room at admission */
	int64_t admit_lookahead;	/* steps of the admission's KV look-ahead */
	bool admit_keeps_room;		/* admissions leave growth room alone */
	uint64_t kv_swap;		/* bytes of KV swap file, 0: off */
	char *kv_swap_path;		/* its directory or new file */
	char *kv_swap_policy;		/* "auto", "always" or "never" */
	uint64_t gpu_memory;
	int64_t threads;
	int64_t numa_node;
	int64_t movers;
	int64_t max_step_tokens;
	int64_t group_tokens;		/* hybrid: rows of a token group */
	int64_t pipeline_sets;		/* hybrid: activation sets (2 or 3) */
	int64_t resident_experts;	/* hybrid: at most this many experts a layer on the GPU; -1: auto */
	uint64_t weight_piece;		/* hybrid: bytes per weight copy */
	char *expert_residency;		/* "auto", "static" or "routing" */
	int64_t expert_residency_period;	/* steps between choices of the resident experts */
	bool foreground;
	char *log_level;
	char *log;
	char *pid_file;
	char *allow_users;
	char *allow_groups;
	int64_t max_tenants;
	int64_t quota_running;
	int64_t quota_kv_blocks;
	int64_t quota_queued;
	double quota_weight;
	int64_t drain_timeout;
	char *attn_kernel;
	bool mlock;
	bool io_uring;
	/* gpus = "0,1": CUDA device ordinals, parsed into gpu_ids[n_gpus] */
	char *gpus;
	int n_gpus;
	int gpu_ids[MLENS_CONFIG_MAX_GPUS];
	bool op_timing;		/* the op time account (daemon/exec/op_time.h) */
	bool profile;
	char *profile_cache;
	int64_t workload_follow;
};

/* Fill in every default. */
void mlens_config_defaults(struct mlens_config *c);
void mlens_config_free(struct mlens_config *c);

/* Parse argv (flags only; no positional arguments). Returns 0, 1 when
 * --help or --version was handled (exit 0), or -EINVAL with err set.
 * Keys given are remembered so that the file does not override them. */
int mlens_config_parse_args(struct mlens_config *c, int argc, char **argv, char *err, size_t errlen);
/* Read a config file; keys set by flags are kept. -errno with err set
 * ("FILE:LINE: ..."). */
int mlens_config_load_file(struct mlens_config *c, const char *path, char *err, size_t errlen);
/* Parse text as a config file would be (tests, fuzzing). */
int mlens_config_load_text(struct mlens_config *c, const char *text, const char *name,
			   char *err, size_t errlen);

/* After flags and file: fill in the values derived from others (control
 * and stats sockets beside the tenant socket when not given). */
int mlens_config_finish(struct mlens_config *c);

/* A GPU list "0,1,3" (spaces allowed around the commas): distinct device
 * ordinals 0..1023, at least one, at most max. Returns the count, or
 * -EINVAL / -ERANGE with why set (no key name: the caller adds it). */
int mlens_parse_gpus(const char *s, int *ids, int max, char *why, size_t whylen);

/* "64K", "2G", "1.5GiB", "1048576": bytes, or -EINVAL / -ERANGE. */
int mlens_parse_size(const char *s, uint64_t *out);

struct mlens_backend_opts;
/* The backend options the gpu_* keys pick for a model (f32_model: its
 * weights are fp32), as mlensd starts its backend with them: the GEMM
 * mode, prefill attention (auto: bf16 tensor cores where the GEMMs are
 * fast and the model 16-bit), copies, fp8 GEMMs, MoE streams and the
 * host's wait. The threads, device and NUMA fields are left alone. */
void mlens_config_backend_opts(const struct mlens_config *c, bool f32_model, struct mlens_backend_opts *bo);

/* Write every key and its value (mlensctl status, mlensd --print-config). */
void mlens_config_dump(const struct mlens_config *c, FILE *f);
void mlens_config_usage(FILE *f);

#endif
