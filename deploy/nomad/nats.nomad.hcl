# A 3-node NATS JetStream cluster on Nomad: one allocation per client node (distinct hosts), host
# networking on the standard ports, a host volume per node for the JetStream store, and the
# Prometheus NATS exporter beside each server (its jetstream_* metrics drive the autoscaler).
#
# The server configuration is deploy/nats/ itself, read by `file()` when the job is submitted: run
# from the repository root.
#   nomad var put nomad/jobs/evalbus-nats NATS_PASSWORD_GATEWAY=... (every user of accounts.conf)
#     NATS_RUNNER_ISSUER=A... (the public key of `evalbus runner-key`, docs/deploy.md)
#   nomad job run deploy/nomad/nats.nomad.hcl
# Each client node needs a host volume named evalbus-nats (client { host_volume "evalbus-nats" {...} }).

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "max_file_store" {
  type        = string
  description = "Bytes of each node's volume JetStream may fill (keep it under the volume's size)."
  default     = "45G"
}

job "evalbus-nats" {
  type        = "service"
  datacenters = var.datacenters

  # One node at a time: the other two keep the quorum of every R3 stream.
  update {
    max_parallel     = 1
    min_healthy_time = "30s"
    healthy_deadline = "5m"
    auto_revert      = true
  }

  group "nats" {
    count = 3

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    volume "data" {
      type      = "host"
      source    = "evalbus-nats"
      read_only = false
    }

    network {
      mode = "host"
      port "client" {
        static = 4222
      }
      port "cluster" {
        static = 6222
      }
      port "monitor" {
        static = 8222
      }
      port "metrics" {
        static = 7777
      }
    }

    service {
      name     = "evalbus-nats"
      port     = "client"
      provider = "nomad"

      check {
        type     = "http"
        port     = "monitor"
        path     = "/healthz?js-enabled-only=true"
        interval = "10s"
        timeout  = "3s"
      }
    }

    # The routes: every node's cluster port, found by Nomad's service discovery.
    service {
      name     = "evalbus-nats-cluster"
      port     = "cluster"
      provider = "nomad"
    }

    service {
      name     = "evalbus-nats-metrics"
      port     = "metrics"
      provider = "nomad"
      tags     = ["metrics"]
    }

    task "nats" {
      driver = "docker"

      # Lame duck mode (30 s) and its grace period (10 s) run before the server stops.
      kill_signal  = "SIGUSR2"
      kill_timeout = "60s"

      config {
        image        = "nats:2.15-alpine"
        network_mode = "host"
        args         = ["--config", "/local/nats.conf"]
      }

      volume_mount {
        volume      = "data"
        destination = "/data"
      }

      env {
        SERVER_NAME         = "evalbus-nats-${NOMAD_ALLOC_INDEX}"
        NATS_STORE_DIR      = "/data"
        NATS_MAX_FILE_STORE = var.max_file_store
        NATS_PID_FILE       = "/local/nats.pid"
      }

      # The shared settings and the users, verbatim from deploy/nats/.
      template {
        data          = file("deploy/nats/jetstream.conf")
        destination   = "local/jetstream.conf"
        change_mode   = "signal"
        change_signal = "SIGHUP"
      }

      template {
        data          = file("deploy/nats/accounts.conf")
        destination   = "local/accounts.conf"
        change_mode   = "signal"
        change_signal = "SIGHUP"
      }

      # The cluster block: routes to every node registered so far (a reload adds later ones).
      template {
        data = <<-EOT
        include ./jetstream.conf

        cluster {
          name: evalbus
          port: 6222
          routes: [
        {{- range nomadService "evalbus-nats-cluster" }}
            nats://{{ .Address }}:{{ .Port }}
        {{- end }}
          ]
          connect_retries: 120
          # Clients list every node in NATS_URL, each with its credentials (docs/deploy.md).
          no_advertise: true
        }
        EOT
        destination   = "local/nats.conf"
        change_mode   = "signal"
        change_signal = "SIGHUP"
      }

      # The users' passwords (NATS_PASSWORD_<USER>) and the runners' credential check's public key
      # (NATS_RUNNER_ISSUER), as environment variables.
      template {
        data = <<-EOT
        {{ with nomadVar "nomad/jobs/evalbus-nats" }}{{ range $k, $v := . }}
        {{ $k }}={{ $v }}
        {{- end }}{{ end }}
        EOT
        destination = "secrets/passwords.env"
        env         = true
        change_mode = "restart"
      }

      resources {
        cpu        = 1000
        memory     = 2048
        memory_max = 4096
      }
    }

    task "exporter" {
      driver = "docker"

      lifecycle {
        hook    = "poststart"
        sidecar = true
      }

      config {
        image        = "natsio/prometheus-nats-exporter:0.20.1"
        network_mode = "host"
        args         = ["-port", "7777", "-varz", "-jsz", "all", "-use_internal_server_name", "http://127.0.0.1:8222"]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
