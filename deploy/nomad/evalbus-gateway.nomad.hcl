# evalbus-gateway on Nomad. The gateway: public HTTP API and web dashboard, the event-store recorder (consumer
# gateway-recorder), batch finalisation. Needs the event store (database_url) and the admin token
# (admin_token) in its Nomad Variable.
#
#   nomad var put nomad/jobs/evalbus-gateway nats_url=... database_url=... admin_token=...
#   nomad job run -var image=registry.example.com/evalbus/gateway:0.1.0 deploy/nomad/evalbus-gateway.nomad.hcl
#
# Credentials come from the job's Nomad Variable, never from this file. Scaled by the Nomad
# Autoscaler on its consumers' lag, read from Prometheus (the NATS exporter of deploy/nomad/nats).

variable "image" {
  type        = string
  description = "The evalbus-gateway image (deploy/docker/gateway.Dockerfile)."
  default     = "evalbus/gateway:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

job "evalbus-gateway" {
  type        = "service"
  datacenters = var.datacenters

  # One allocation at a time; a new version that does not turn healthy is rolled back.
  update {
    max_parallel      = 1
    min_healthy_time  = "10s"
    healthy_deadline  = "5m"
    progress_deadline = "10m"
    auto_revert       = true
  }

  group "gateway" {
    count = 2

    network {
      port "http" {
        to = 8080
      }
    }

    service {
      name     = "evalbus-gateway"
      port     = "http"
      provider = "nomad"
      tags     = ["evalbus", "metrics"]

      check {
        name     = "ready"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "3s"
      }

      check {
        name     = "alive"
        type     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "3s"

        check_restart {
          limit = 3
          grace = "60s"
        }
      }
    }

    scaling {
      enabled = true
      min     = 2
      max     = 6

      policy {
        evaluation_interval = "30s"
        cooldown            = "2m"

        # ceil(lag / 2000): KEDA's AverageValue rule, 2000 messages of lag per allocation.
        check "gateway-recorder" {
          source       = "prometheus"
          query        = "ceil((max(jetstream_consumer_num_pending{stream_name=\"CASES\",consumer_name=\"gateway-recorder\",is_consumer_leader=\"true\"}) + max(jetstream_consumer_num_ack_pending{stream_name=\"CASES\",consumer_name=\"gateway-recorder\",is_consumer_leader=\"true\"})) / 2000) or vector(0)"
          query_window = "1m"
          on_error     = "ignore"

          strategy "pass-through" {}
        }
      }
    }

    task "gateway" {
      driver = "docker"

      # Longer than SHUTDOWN_TIMEOUT_S (30 s): in-flight work finishes before SIGKILL.
      kill_signal  = "SIGTERM"
      kill_timeout = "50s"

      config {
        image = var.image
        ports = ["http"]
      }

      env {
        LOG_LEVEL          = "INFO"
        LOG_FORMAT         = "json"
        HTTP_HOST          = "0.0.0.0"
        HTTP_PORT          = "8080"
        SHUTDOWN_TIMEOUT_S = "30"
        EVALBUS_STATE_DIR  = "/var/lib/evalbus"
      }

      # NATS_URL holds this service's NATS user and password (deploy/nats/accounts.conf).
      template {
        data = <<-EOT
        {{ with nomadVar "nomad/jobs/evalbus-gateway" }}
        NATS_URL={{ .nats_url }}
        DATABASE_URL={{ .database_url }}
        GATEWAY_ADMIN_TOKEN={{ .admin_token }}
        {{ end }}
        EOT
        destination = "secrets/evalbus.env"
        env         = true
        change_mode = "restart"
      }

      resources {
        cpu        = 500
        memory     = 256
        memory_max = 1024
      }
    }
  }
}
