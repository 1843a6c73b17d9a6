// Java's admin client asking for the cluster's operations, for the integration tests of
// the proxy's cluster ACLs; run with Java's single-file source launcher on the Kafka
// jars' classpath:
//
//     java -cp 'libs/*' ClusterAdmin.java <bootstrap> <client id> <user> <broker id>
//
// Creates two ACLs (for groups), upserts a SCRAM credential for <user> and describes it,
// describes the broker's configs, printing "<call> ok" or "<call> <the exception's class>" for each binding and call.
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.CreateAclsResult;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;
import org.apache.kafka.common.KafkaFuture;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.config.ConfigResource;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class ClusterAdmin {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], clientId = args[1], user = args[2], brokerId = args[3];
        try (Admin admin = Admin.create(Map.of("bootstrap.servers", bootstrap,
                                               "client.id", clientId))) {
            List<AclBinding> bindings = new ArrayList<>();
            for (int i = 0; i < 2; i++) {
                bindings.add(new AclBinding(
                    new ResourcePattern(ResourceType.GROUP, clientId + "-g" + i, PatternType.LITERAL),
                    new AccessControlEntry("User:app", "*", AclOperation.READ,
                                           AclPermissionType.ALLOW)));
            }
            CreateAclsResult created = admin.createAcls(bindings);
            for (AclBinding binding : bindings) {
                print("createAcls", created.values().get(binding));
            }
            UserScramCredentialUpsertion upsert = new UserScramCredentialUpsertion(
                user, new ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 4096), "secret");
            print("alterUserScramCredentials", admin.alterUserScramCredentials(List.of(upsert)).all());
            print("describeUserScramCredentials",
                  admin.describeUserScramCredentials(List.of(user)).description(user));
            ConfigResource broker = new ConfigResource(ConfigResource.Type.BROKER, brokerId);
            print("describeConfigs", admin.describeConfigs(List.of(broker)).values().get(broker));
        }
    }

    private static void print(String call, KafkaFuture<?> future) throws InterruptedException {
        try {
            future.get();
            System.out.println(call + " ok");
        } catch (ExecutionException e) {
            System.out.println(call + " " + e.getCause().getClass().getSimpleName());
        }
    }
}
